"""A user's image data set in the format of the seed it comes from (an ImageFolder tree, a COCO
directory), planned for ``raytrain-loops convert`` and read back by the vision tasks: the scan and
checks of a source, each part's Parquet file, and the converted set's ``meta.json``. Ray-free:
the conversion's Ray Data execution is ``raytrain_loops/tools/convert.py``."""
