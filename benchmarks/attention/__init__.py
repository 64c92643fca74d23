"""MultiHeadAttention on the CPU EP against the same attention from standard ONNX ops (``bench``)."""
