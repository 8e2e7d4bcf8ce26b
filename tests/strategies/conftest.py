"""Strategy tests: import torch._dynamo at collection time.

torch imports ``torch._dynamo`` lazily (first optimizer step, first ``get_state_dict``), and that
import sets ``TORCHINDUCTOR_CACHE_DIR`` in ``os.environ``; importing it here keeps the suite's
env-leak guard from blaming whichever test happens to trigger it first.
"""

import torch._dynamo  # noqa: F401
