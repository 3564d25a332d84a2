"""Low-precision formats, emulated on CPU by quantize -> dequantize (see fp8.py)."""
