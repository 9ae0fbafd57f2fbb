import sys

from vitlab.cli import main

sys.exit(main())
