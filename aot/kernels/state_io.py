"""The state I/O flags of the kernels that read initial states and write final states: bits of their run-time
argument state_mode (flash_qla/states.py holds the same values for the host; a CPU test compares them)."""
V_FIRST = 1        # the caller's states are [.., Hv, V, K] (FLA's and FlashInfer's layout), else [.., Hv, K, V]
READ_INDEXED = 2   # sequence n's initial state is row state_idx[n] of a pool (a negative entry: zero state)
WRITE_INDEXED = 4  # sequence n's final state goes to row state_idx[n] (a negative entry: nothing is written)
