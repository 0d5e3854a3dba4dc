"""The load-test harness behind ``infergate bench`` and the offline batch jobs."""
