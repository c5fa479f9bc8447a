"""The GPU backend: Triton paged attention (attention.py), CUDA graphs for decode steps (cuda_graphs.py), torch's ops
for the rest. Nothing here imports triton until a GPU backend is built: on the CPU it must stay unimported."""
