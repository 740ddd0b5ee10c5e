"""Feeds in other tools' formats, built from the history: the Perfetto / Chrome trace
(``perfetto``), and the experiment trackers (``tracker_data``: the per-step points and params
all three get; ``tensorboard``, ``mlflow_export``, ``wandb_export``: each tracker's writer, its
package imported only there). docs/export.md."""
