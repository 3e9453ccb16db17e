"""TileLang GDN kernels; each module declares its variant axes (VARIANTS) and build(**variant) -> PrimFunc."""
