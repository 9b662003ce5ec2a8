import os
import sys

# tests import their shared model zoo as a plain module
sys.path.insert(0, os.path.dirname(__file__))
