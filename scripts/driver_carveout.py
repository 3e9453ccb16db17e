"""Experiment knob (GPU machine): load every kernel with the driver's shared-memory carveout, ignoring the manifest's.

gdn_fwd's save build and gdn_bwd_dh ask for the SM's whole carveout, so that two CTAs (theirs or each other's) fit an
SM; with the driver's choice they do not. Used by scripts/hunt_backward_hang.py (HUNT_NO_CARVEOUT=1) and
scripts/profile_bwd_case.py (PROFILE_NO_CARVEOUT=1) to tell co-residency apart from the kernels themselves.
"""
import flash_qla.loader as loader


class _DriverCarveout:
    def __init__(self, nat):
        self._nat = nat

    def __getattr__(self, name):
        return getattr(self._nat, name)

    def get_function(self, module, symbol, smem, carveout=-1):
        return self._nat.get_function(module, symbol, smem, -1)


def use_driver_carveout() -> None:
    real_native = loader.native
    loader.native = lambda: _DriverCarveout(real_native())
    print("driver's shared-memory carveout for every kernel", flush=True)
