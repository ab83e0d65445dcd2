"""The exporter: ONNX step graphs, the TorchScript steps, the folded weights, a manifest and a stock-Triton repository
for an upstream ``hift.pt`` (the model itself is :mod:`hift_model`)."""
