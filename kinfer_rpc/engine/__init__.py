"""The engine layer: one loaded model's scheduler. Jobs, slots and their KV cells, sampling,
drafting and text streaming, on one worker thread that owns the device. Knows nothing of JSON."""
