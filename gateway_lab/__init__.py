"""The gateway's lab: the SGLang-compatible simulator, trace replay on the virtual clock, the demo, and the
real-engine kit. It imports the runtime (`gateway`) to measure the shipped code; the runtime never imports it."""
