"""Ways to run an engine over a plan: in this process (`local`) or across Ray actors (`ray`);
`sinks` is where both hand their results."""
