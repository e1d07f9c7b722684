"""The routing scorers, one file per family. Each gives every candidate a score in [0, 1]: higher is better.

They are registered, with the policy field holding each one's weight, in routing/scheduling/__init__.py.
"""
