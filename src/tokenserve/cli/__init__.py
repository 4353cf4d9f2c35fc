"""`tokenserve <command>`."""
