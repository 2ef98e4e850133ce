"""The feedback-ingester service:
takes product feedback over HTTP and joins it with served generations.
"""
