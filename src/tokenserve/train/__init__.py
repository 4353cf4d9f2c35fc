"""Training the built-in models (`tokenserve train`)."""
