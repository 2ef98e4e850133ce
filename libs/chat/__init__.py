"""Chat templates and the tool-call format: how conversations become token ids and back."""
