"""A worker that is slow to start (sleeps before running the bundled job): the window in which a new
world's workers are still starting up."""

import os
import runpy
import sys
import time

time.sleep(float(os.environ.get("SLOW_START_S", "30")))
sys.argv = [sys.argv[0], *sys.argv[1:]]
runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt_elastic.py"), run_name="__main__")
