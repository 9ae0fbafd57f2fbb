"""Shared set-up of the weight tests."""
import os
import sys

import pytest
import torch

# the numpy references of one test file are reused by others (pytest runs with --import-mode=importlib)
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine the threads
    of parallel workers fight for the same cores; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
