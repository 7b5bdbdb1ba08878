"""Scratch: the fitted key scale read from the prompt's last QJL_FIT_ROWS queries per query head (the library: 32)."""
import os
import sys

import qjl.cache.key_scale as key_scale
import qjl.cache.storage as storage

rows = int(os.environ.get("QJL_FIT_ROWS", key_scale.FIT_ROWS))
key_scale.FIT_ROWS = storage.FIT_ROWS = rows
print(f"FIT_ROWS = {rows}", flush=True)
if __name__ == "__main__":
    from qjl.tools.cli import main
    sys.exit(main())
