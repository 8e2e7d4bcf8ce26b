"""Write this worker's environment to ``<DIR>/rank-<RANK>.json`` (the torchrun-parity test)."""

import json
import os
import sys

with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(dict(os.environ), fh, indent=1, sort_keys=True)
