"""Inference engines behind one interface: `InferenceEngine`, built by `build_engine`.

`base` holds the interface and its value types, `hf` the embedded torch/transformers engine,
`factory` the config and the one factory that picks a backend by its `type` field.
"""
