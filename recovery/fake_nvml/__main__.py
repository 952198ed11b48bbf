"""``python -m gpufleet.recovery.fake_nvml``: inject faults on a node agent's fake GPUs
(``inject.py``)."""

import sys

from .inject import main

sys.exit(main())
