import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# --compile's default, auto, starts a background compile for each model shape it has not compiled
# before: the suite loads hundreds of tiny models of many shapes, so it runs eager unless a test
# asks for auto or now itself (tests/test_compile_cache.py tests auto).
os.environ.setdefault("LLMSPLIT_COMPILE", "off")
