/* ---- Repacking GGUF blocks into the kernels' tiles at load (filled in below) ---- */
