"""The run wing: typed configuration and its command line, the run directory and its record, and plugin discovery.

The engine room holds the loop; everything a run keeps about itself (what was asked,
which code ran it, where its files go, which plugins it can name) lives here.
"""
