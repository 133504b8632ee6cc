"""Board URLs, included in the console's namespace."""

from django.urls import path

from . import views

urlpatterns = [
    path("board/", views.board, name="board"),
    path("board/launch/", views.board_launch, name="board-launch"),
    path("board/<str:launch_id>/teardown/", views.board_teardown, name="board-teardown"),
]
