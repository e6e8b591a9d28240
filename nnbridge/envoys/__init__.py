"""Proxy layer: the nnsight-compatible Envoy tree whose children include op envoys (not built yet)."""
