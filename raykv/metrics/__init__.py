"""raykv's metrics: the catalog (``catalog``), recorders engines and actors
use (``recorders``), and reading the series back from the nodes (``scrape``)."""

from raykv.metrics.catalog import SPECS, MetricSpec, exported_names, metric, record

__all__ = ["SPECS", "MetricSpec", "exported_names", "metric", "record"]
