"""The reference the stored states are checked against, independent of the engines: the checkpoint's own class streamed one decoder layer at a time (`streamed`), and the comparison (`check`)."""
