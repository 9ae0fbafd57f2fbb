"""Harnesses the tests drive, also runnable on their own for longer budgets:

    python tests/helpers/fuzz.py --seconds 30        # fuzz the readers of untrusted bytes
    python tests/helpers/kill_resume.py --kills 10   # SIGKILL training at random moments, resume

The tests import them as ``helpers.fuzz`` and ``helpers.kill_resume`` (pytest puts ``tests/``
on the path: ``pythonpath`` in pyproject.toml).
"""
