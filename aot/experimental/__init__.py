"""Kernel builds measured as experiments: not in the build matrix (build_matrix.variants.KERNELS) nor shipped.

Build one into a copy of the shipped kernel directory with scripts/experiment_kernel_dir.py; each module's docstring
says where it stands and names its record under bench/results/experiments/."""
