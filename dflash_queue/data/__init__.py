"""Reading prompt datasets into samples."""
