"""Adapters that plug ``optimizer.Muon`` into training frameworks.

Each adapter is its own module and imports its framework when it is imported, so
``import optimizer`` never needs one: ``from optimizer.integrations.torchtitan import ...``
works where torchtitan is installed and raises an ImportError that says how to install it
elsewhere.
"""
