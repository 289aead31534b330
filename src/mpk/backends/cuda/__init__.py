"""CUDA backend: renders the megakernel for a Plan (codegen), builds it with nvcc (build), loads
it (loader) and runs it (executor.CudaExecutor). Handwritten device code lives in csrc/."""
