"""Calibration: data, quantized drafts and targets, quality reports, and draft-length (γ) calibration.

Depends on specdec.export and specdec.runtime; the runtime never imports this package.
"""
