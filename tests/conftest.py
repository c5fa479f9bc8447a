import os

# Nothing here pins the dtype or torch's thread count. The engine and router tests pass dtype float32 themselves
# (outputs are compared token for token, with the fp32 transformers reference among others); torch's threads
# follow the CPU quota unless a test passes --num-threads. Only the tokenizers' own thread pool is off: it would
# compete with torch's threads, and warn when a test forks a server after using it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
