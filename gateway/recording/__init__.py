"""The gateway's anonymized request recording (`recording.path`) and its trace format, which `gateway replay`
(the lab package) reads."""
