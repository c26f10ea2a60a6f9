"""The run's typed configuration (`TrainConfig`, one documented field per flag), the model
shapes and learning-rate schedules it names, and the field helper every config uses.
"""
