"""What a chain's temperature is and how it is read: rules, estimates, the monitor."""
