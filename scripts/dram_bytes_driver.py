"""One backward call of a matrix row under the CUDA profiler's start / stop, for `ncu --profile-from-start off`
(GPU machine): which library answers is whichever `flash_qla` is first on the path (ours from the repository
root, FlashQLA's through scripts/peer_env.sh), both through the same low-level API and peer_bench.py's inputs.
usage: python scripts/dram_bytes_driver.py PEERS_DIR MODEL SEQS   (e.g. .peers hk16_hv32 32k_8seq)
"""
import json
import sys

import torch


def main():
    peers_dir, model, seqs = sys.argv[1:4]
    sys.path.insert(0, peers_dir)
    import peer_bench  # the peers' own input recipe, so both libraries see the same tensors
    matrix = json.load(open(f"{peers_dir}/matrix.json"))
    hq, hv = next((a, b) for name, a, b in matrix["bwd"]["models"] if name == model)
    lengths = next(s for label, s in matrix["bwd"]["seqs"] if label == seqs)
    import flash_qla  # FlashQLA's low-level API, which ours is a drop-in for (called as peer_bench.py calls it)
    d = peer_bench.make(lengths, hq, hv, matrix["head_dim"])
    g_cumsum, A = flash_qla.chunk_gated_delta_rule_fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=d["scale"],
                                                       initial_state=d["h0"], output_final_state=True,
                                                       cu_seqlens=d["cu"])[:2]

    def call():
        return flash_qla.chunk_gated_delta_rule_bwd(d["q"], d["k"], d["v"], g_cumsum, d["beta"], A, d["do"],
                                                    dht=d["dht"], scale=d["scale"], initial_state=d["h0"],
                                                    cu_seqlens=d["cu"])
    print("library:", flash_qla.__file__, flush=True)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
