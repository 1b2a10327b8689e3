"""Learning from past requests: request tracking and trace windows (tracking), output-length
prediction (predictor) and per-engine prefill/decode profiles (profiles).

It imports routing's core modules (pods, background) and nothing from scheduling.
"""
