import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Two threads on CI's two cores; fewer when the machine is shared with a background job.
torch.set_num_threads(int(os.environ.get("DFLASH_TEST_THREADS", "2")))
