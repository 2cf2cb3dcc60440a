"""tokq-worker: claims token-budget batches from Redis and runs unpadded forward passes."""
