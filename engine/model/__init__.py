"""The device side: weights, paged KV cache, paged-attention forward, counter-based sampling, block copies, loaders
and the executors. Import each from its module (``tickloom.engine.model.stub``, ``.loaders``, ...): importing this
package imports nothing, so ``tickloom.engine.model.stub`` and ``.types`` never pull in torch."""
