"""Build-time only: TileLang kernel definitions and the compiler driver (never imported by flash_qla)."""
