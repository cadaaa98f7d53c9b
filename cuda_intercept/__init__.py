"""The client side of the CUDA route: a generated, cffi-built libcuda.so.1 that forwards driver calls to rgpu serve."""
