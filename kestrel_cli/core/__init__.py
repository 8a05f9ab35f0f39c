"""Layer 0, the leaves: errors, the memory helpers (huge pages, page drop, free memory) and
the CPU / thread choice. Imports nothing of kestrel_cli."""
