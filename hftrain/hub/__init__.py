"""Sharing a finished run on the Hub: artifact checks, the model card, the push (see push.py for the flow)."""
