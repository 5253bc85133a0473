"""The server side of data parallelism: the controller (controller.py) over the rank
supervisor (supervisor.py) and the request router (router.py), its one client
(controller_client.py), and the ranks' stats merged (stats.py). The per-step consensus
between ranks is the model executor's (model_executor/dp_sync.py)."""
