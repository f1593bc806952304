"""Loaded (through PYTHONPATH) only by the vLLM engines the MooncakeConnector tests start.

vLLM 0.32.0 `distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py` line 1186,
`MooncakeConnectorWorker.__init__`: `self.device_id = torch.accelerator.current_device_index()`.
On a torch without an accelerator that raises "Cannot access accelerator device when none is
available", so the connector cannot start on a CPU; the next line hands the index to
`current_platform.set_device`, which on vLLM's CPU platform is `torch.cpu.set_device` (a no-op).
Here, and only where no accelerator exists, the index is 0. Nothing else is changed: the connector,
its bootstrap server and Mooncake's TCP transport run as shipped."""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
