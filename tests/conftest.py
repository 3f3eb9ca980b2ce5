import os
import sys

# Tests run ranks with one thread each (2 cores, up to 4 ranks); keep the parent quiet too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
