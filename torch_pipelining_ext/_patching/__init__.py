"""The patch machinery: the registry (``_registry.py``), the patch table
(``patches.json``, read by ``_table.py``) and every feature probe (``_probes.py``).

Feature modules never import this package; the table imports them.
"""
