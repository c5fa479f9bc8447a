import os

# Tests pin float32 and a fixed thread count so outputs are comparable run to run.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
