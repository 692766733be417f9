"""A user's image data set in the format of the seed it comes from (an ImageFolder tree, a COCO
directory), planned for ``raytrain-loops convert`` and read back by the vision tasks: the scan and
checks of a source, each part's Parquet file, the converted set's ``meta.json``, and a stored data
set's identity (``identity.py``, also the staging record's and the converted tasks' digest). Ray-free:
the conversion's Ray Data execution is ``raytrain_loops/tools/convert.py``."""
